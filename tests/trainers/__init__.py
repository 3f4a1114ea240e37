"""Tests of the trainer adapters (`trainers/`)."""
