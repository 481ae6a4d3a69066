"""Transports: each translates its wire format to the serving core and back."""
