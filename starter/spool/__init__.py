"""Shared executables: one copy per owner and content, hard links as refcounts."""
