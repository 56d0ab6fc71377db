"""Runnable experiment scripts; each has --help and writes to a folder it names."""
