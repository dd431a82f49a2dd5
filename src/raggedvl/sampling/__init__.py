"""raggedvl.sampling"""
