"""The package version, in the bottom layer so that every layer can name it without importing the package root
(which imports every layer)."""

__version__ = "0.1.0"
