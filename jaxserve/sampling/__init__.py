"""Jittable next-token sampling."""
