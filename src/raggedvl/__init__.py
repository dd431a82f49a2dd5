"""raggedvl: correct and fast data-parallel training of dynamic-resolution VLMs.

Public API (re-exported here): see README.md.
"""

__version__ = "0.1.0"
