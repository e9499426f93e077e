"""Fixed fact tables the synthetic corpus is written from.

Countries and capitals are real; currencies are real; people are invented. The tables are
the ground truth for both training text and the held-out evaluation.
"""

from __future__ import annotations

# (country, capital, currency)
COUNTRIES: list[tuple[str, str, str]] = [
    ("France", "Paris", "euro"),
    ("Germany", "Berlin", "euro"),
    ("Italy", "Rome", "euro"),
    ("Spain", "Madrid", "euro"),
    ("Portugal", "Lisbon", "euro"),
    ("Ireland", "Dublin", "euro"),
    ("Greece", "Athens", "euro"),
    ("Austria", "Vienna", "euro"),
    ("Finland", "Helsinki", "euro"),
    ("Netherlands", "Amsterdam", "euro"),
    ("United Kingdom", "London", "pound sterling"),
    ("Switzerland", "Bern", "Swiss franc"),
    ("Sweden", "Stockholm", "Swedish krona"),
    ("Norway", "Oslo", "Norwegian krone"),
    ("Denmark", "Copenhagen", "Danish krone"),
    ("Poland", "Warsaw", "zloty"),
    ("Hungary", "Budapest", "forint"),
    ("Czechia", "Prague", "Czech koruna"),
    ("Russia", "Moscow", "ruble"),
    ("Turkey", "Ankara", "lira"),
    ("Egypt", "Cairo", "Egyptian pound"),
    ("Nigeria", "Abuja", "naira"),
    ("Kenya", "Nairobi", "Kenyan shilling"),
    ("South Africa", "Pretoria", "rand"),
    ("Morocco", "Rabat", "dirham"),
    ("India", "New Delhi", "rupee"),
    ("China", "Beijing", "yuan"),
    ("Japan", "Tokyo", "yen"),
    ("South Korea", "Seoul", "won"),
    ("Thailand", "Bangkok", "baht"),
    ("Vietnam", "Hanoi", "dong"),
    ("Indonesia", "Jakarta", "rupiah"),
    ("Australia", "Canberra", "Australian dollar"),
    ("New Zealand", "Wellington", "New Zealand dollar"),
    ("Canada", "Ottawa", "Canadian dollar"),
    ("United States", "Washington", "US dollar"),
    ("Mexico", "Mexico City", "Mexican peso"),
    ("Brazil", "Brasilia", "real"),
    ("Argentina", "Buenos Aires", "Argentine peso"),
    ("Chile", "Santiago", "Chilean peso"),
    ("Peru", "Lima", "sol"),
    ("Colombia", "Bogota", "Colombian peso"),
]

CITIES: list[str] = sorted(
    {capital for _, capital, _ in COUNTRIES}
    | {
        "Lyon",
        "Munich",
        "Milan",
        "Barcelona",
        "Porto",
        "Osaka",
        "Toronto",
        "Chicago",
        "Boston",
        "Sydney",
        "Seattle",
        "Hamburg",
        "Geneva",
        "Zurich",
        "Krakow",
        "Mumbai",
    }
)

_FIRST = [
    "Alice",
    "Bob",
    "Carol",
    "David",
    "Emma",
    "Frank",
    "Grace",
    "Henry",
    "Irene",
    "Jack",
    "Karen",
    "Leo",
    "Maria",
    "Nathan",
    "Olivia",
    "Paul",
    "Quinn",
    "Rosa",
    "Samuel",
    "Tara",
    "Umar",
    "Vera",
    "Walter",
    "Xenia",
    "Yusuf",
    "Zoe",
    "Amir",
    "Bianca",
    "Carlos",
    "Dana",
    "Elena",
    "Felix",
    "Gina",
    "Hugo",
    "Ines",
    "Jonas",
    "Kira",
    "Lucas",
    "Mina",
    "Noah",
    "Omar",
    "Petra",
    "Rafael",
    "Sofia",
    "Tomas",
    "Ursula",
    "Victor",
    "Wendy",
    "Yara",
    "Ziggy",
]
_LAST = [
    "Smith",
    "Garcia",
    "Novak",
    "Tanaka",
    "Muller",
    "Rossi",
    "Silva",
    "Kim",
    "Dubois",
    "Larsen",
]
JOBS = [
    "teacher",
    "engineer",
    "doctor",
    "baker",
    "pilot",
    "nurse",
    "artist",
    "farmer",
    "lawyer",
    "chef",
    "writer",
    "designer",
    "student",
    "plumber",
    "scientist",
    "musician",
]
HOBBIES = [
    "chess",
    "hiking",
    "painting",
    "cooking",
    "running",
    "reading",
    "swimming",
    "gardening",
    "cycling",
    "photography",
    "singing",
    "dancing",
    "fishing",
    "knitting",
    "climbing",
    "tennis",
]


def _people() -> list[tuple[str, int, str, str]]:
    """~50 invented people: (full name, age, city, job); a fixed arithmetic pattern, no RNG."""
    out = []
    for i, first in enumerate(_FIRST):
        last = _LAST[(i * 7) % len(_LAST)]
        age = 19 + (i * 37) % 61
        city = CITIES[(i * 11) % len(CITIES)]
        job = JOBS[(i * 5) % len(JOBS)]
        out.append((f"{first} {last}", age, city, job))
    return out


PEOPLE: list[tuple[str, int, str, str]] = _people()
