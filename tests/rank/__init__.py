"""What runs inside a rank: the step loop, its clock, its records."""
