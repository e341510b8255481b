"""Tests of the instances: the replicated set of models asked for."""
