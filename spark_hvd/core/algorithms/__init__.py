"""Algorithms: collective algorithms written against the transport's peers (agreed-size ring rounds, halving-doubling,
recursive doubling, the hierarchical pipeline, Adasum). Imports the transport and the ground floor only."""
