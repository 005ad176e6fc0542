"""`python -m rtrain`: the rtrain command, as the console script runs it."""

from rtrain.supervisor.cli import main

main()
