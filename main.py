"""Train a character-level GPT: `python main.py [key=value ...]`.

The recipe is in mingpt/train.py, the configuration in mingpt/config.py and conf/.
"""

from mingpt.train import main

if __name__ == "__main__":
    main()
