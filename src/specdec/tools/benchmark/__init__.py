"""Measuring specdec: prompt sets and the runs that time them."""
