"""`python -m kvsim`: the command line."""

if __name__ == "__main__":
    from kvsim.sim.cli.app import main

    main()
