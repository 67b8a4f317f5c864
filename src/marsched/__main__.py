"""`python -m marsched`: the `marsched` command."""

from marsched.cli import app

app()
