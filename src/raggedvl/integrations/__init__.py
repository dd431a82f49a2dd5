"""Adapters that let other tools run raggedvl retrievers: :mod:`raggedvl.integrations.mteb`
(mteb's evaluation, the ViDoRe leaderboard's). Nothing is imported here; each module imports
its tool, an optional dependency (``pip install 'raggedvl[mteb]'``)."""
