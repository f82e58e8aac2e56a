"""Models, configurations and train steps shared by several test modules."""
