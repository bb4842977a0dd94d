"""The value types every layer shares."""
