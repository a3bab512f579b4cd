"""Checkpoints, consolidated export and loading published weights."""
