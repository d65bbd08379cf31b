"""Activation predictors: their training sample, ranks, training and measured quality."""
