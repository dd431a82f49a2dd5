"""Adapters that let other tools run raggedvl retrievers: :mod:`raggedvl.integrations.mteb`
(mteb's evaluation, the ViDoRe leaderboard's). Nothing is imported here: each adapter imports
its tool only when used."""
