from .errors import *
