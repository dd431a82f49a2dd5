"""raggedvl.losses"""
