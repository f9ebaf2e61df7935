"""Policies: readings + time in, decision + reason out. Pure: no I/O and no clock of its own."""
