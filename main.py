"""Train a character-level GPT: `python main.py [key=value ...]`.

The recipe is in mingpt/train.py, the configuration in mingpt/config.py and conf/.
"""

from mingpt import stopping

stopping.install()  # first: Ctrl-C during the imports below ends the process with one line

from mingpt.train import main  # noqa: E402

if __name__ == "__main__":
    main()
