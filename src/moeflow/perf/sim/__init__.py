"""The simulator's machinery."""
