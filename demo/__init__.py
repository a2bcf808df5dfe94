"""The tb-numerics demo: real training failures, diagnosed.

``python -m demo`` runs every story in ``demo.stories`` into a logdir and
prints each run's diagnosis; ``--serve`` then starts TensorBoard on it.
"""
