"""raggedvl.train"""
