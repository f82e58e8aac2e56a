"""The vendored tests run through ``tests/compat/jmp_test.py`` (which marks jaxamp's
deliberate differences), not on their own: collecting them here would run them twice."""

collect_ignore_glob = ["*_test.py"]
