"""Adapters that speak one inference engine's interfaces and translate them to kvstage's."""
