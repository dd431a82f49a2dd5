"""raggedvl.data"""
