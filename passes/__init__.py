"""Graph passes: capture, cost annotation, strategy enumeration, problem building, lowering."""
