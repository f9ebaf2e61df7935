"""The bottom layer: small shared leaves every other package may import (errors); it imports nothing of ours."""
