"""jmp's own tests, vendored; ``tests/compat/jmp_test.py`` runs them against jaxamp."""
