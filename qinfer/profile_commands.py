"""`qinfer prep profile` and `qinfer prep train-predictor`: activation statistics and predictors for any ReLU model."""
