"""Supported models on the Hugging Face hub: their profiles and the download that lays them out."""
