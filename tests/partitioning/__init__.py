"""Tests of partitioning."""
