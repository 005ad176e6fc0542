"""`rtrain launch`: the supervision loop."""
