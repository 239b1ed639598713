"""Exact formulations (ILP in PuLP, CP-SAT in OR-Tools), one file per problem and model."""
