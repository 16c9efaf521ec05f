"""The reward service: rule scorers and generative reward models, keyed by data_source."""
