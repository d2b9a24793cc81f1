"""A trained run as a function: scoring (log-likelihoods of continuations, rolling log-likelihoods,
generation until stop strings) and the lm-evaluation-harness model built on it."""
