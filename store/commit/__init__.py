"""Committing a save and what the commit names: the marker protocol, locating a generation's objects, gc."""
