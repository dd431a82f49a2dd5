"""raggedvl.batch"""
