"""Paper reproductions and studies built on the etweedie library (not installed with it).

Each folder is one experiment; run its entry points from the repository root with
``python -m experiments.<folder>.<module>``.  They import only public etweedie names.
"""
