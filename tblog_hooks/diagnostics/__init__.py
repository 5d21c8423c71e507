"""Diagnose: health findings read off the logged scalars, and the pictures and text summaries
written with each step."""
