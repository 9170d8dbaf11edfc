"""`python -m pan2cli ...` runs the same CLI as the `pan2` script."""

from pan2cli.cli import main

if __name__ == "__main__":
    main()
