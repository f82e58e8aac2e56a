"""The policy advisor: ``suggest_policy``."""
