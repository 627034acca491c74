"""Command-line front ends; library modules do not own argparse CLIs."""
