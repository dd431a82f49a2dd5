"""raggedvl.parallel"""
