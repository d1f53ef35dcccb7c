"""Small real models for tests, calibration examples and evaluation."""
