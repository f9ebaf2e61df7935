"""Readings from the device: temperatures, battery, memory and CPU frequency, under one root prefix."""
