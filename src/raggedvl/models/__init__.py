"""raggedvl.models"""
