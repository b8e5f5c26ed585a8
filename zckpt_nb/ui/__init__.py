"""Figures, tables and ipywidgets panels."""
