"""Minimal reproductions of upstream bugs, with no code of this project in the models."""
