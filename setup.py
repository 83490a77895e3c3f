"""Thin setup.py so `pip install -e .` works with older pips; metadata lives in pyproject.toml."""
from setuptools import setup

setup()
