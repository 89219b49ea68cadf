"""Write the calibration sets beside this script: facts.jsonl and arithmetic.jsonl.

facts.jsonl: questions written for tokentrail (world capitals, chemical symbols, and
capitals as a four-way choice), released under the project's MIT licence. The facts are
common knowledge; the wording and selection are ours. arithmetic.jsonl: sums and
products generated with a fixed seed, by digit count. generated.jsonl: a larger set
(1,600 questions) of families with exact answers, generated with its own seed: sums,
differences, products, the number after or before one, doubles (free text), and which
of two numbers is larger or whether one is even or odd (two-way choices). Run `python
make_sets.py` to rebuild all three files byte for byte.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 30

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Portugal": "Lisbon", "the United Kingdom": "London", "Ireland": "Dublin",
    "Belgium": "Brussels", "the Netherlands": "Amsterdam", "Austria": "Vienna",
    "Switzerland": "Bern", "Poland": "Warsaw", "the Czech Republic": "Prague",
    "Hungary": "Budapest", "Greece": "Athens", "Sweden": "Stockholm", "Norway": "Oslo",
    "Denmark": "Copenhagen", "Finland": "Helsinki", "Iceland": "Reykjavik",
    "Russia": "Moscow", "Ukraine": "Kyiv", "Romania": "Bucharest", "Bulgaria": "Sofia",
    "Serbia": "Belgrade", "Croatia": "Zagreb", "Slovakia": "Bratislava",
    "Slovenia": "Ljubljana", "Estonia": "Tallinn", "Latvia": "Riga",
    "Lithuania": "Vilnius", "Belarus": "Minsk", "Turkey": "Ankara", "Egypt": "Cairo",
    "Morocco": "Rabat", "Algeria": "Algiers", "Tunisia": "Tunis", "Libya": "Tripoli",
    "Nigeria": "Abuja", "Ghana": "Accra", "Kenya": "Nairobi", "Ethiopia": "Addis Ababa",
    "Uganda": "Kampala", "Tanzania": "Dodoma", "Senegal": "Dakar", "Mali": "Bamako",
    "Angola": "Luanda", "Zimbabwe": "Harare", "Zambia": "Lusaka",
    "Mozambique": "Maputo", "Madagascar": "Antananarivo", "Sudan": "Khartoum",
    "Somalia": "Mogadishu", "Rwanda": "Kigali", "China": "Beijing", "Japan": "Tokyo",
    "South Korea": "Seoul", "North Korea": "Pyongyang", "India": "New Delhi",
    "Pakistan": "Islamabad", "Bangladesh": "Dhaka", "Nepal": "Kathmandu",
    "Sri Lanka": "Colombo", "Thailand": "Bangkok", "Vietnam": "Hanoi",
    "Cambodia": "Phnom Penh", "Laos": "Vientiane", "Malaysia": "Kuala Lumpur",
    "Indonesia": "Jakarta", "the Philippines": "Manila", "Singapore": "Singapore",
    "Mongolia": "Ulaanbaatar", "Afghanistan": "Kabul", "Iran": "Tehran", "Iraq": "Baghdad",
    "Syria": "Damascus", "Lebanon": "Beirut", "Jordan": "Amman",
    "Saudi Arabia": "Riyadh", "Yemen": "Sanaa", "Oman": "Muscat", "Qatar": "Doha",
    "Kuwait": "Kuwait City", "Kazakhstan": "Astana",
    "Uzbekistan": "Tashkent", "Georgia": "Tbilisi", "Armenia": "Yerevan",
    "Azerbaijan": "Baku", "the United States": "Washington", "Canada": "Ottawa",
    "Mexico": "Mexico City", "Cuba": "Havana", "Jamaica": "Kingston",
    "Guatemala": "Guatemala City", "Honduras": "Tegucigalpa", "Nicaragua": "Managua",
    "Costa Rica": "San Jose", "Panama": "Panama City", "Colombia": "Bogota",
    "Venezuela": "Caracas", "Ecuador": "Quito", "Peru": "Lima", "Bolivia": "Sucre",
    "Chile": "Santiago", "Argentina": "Buenos Aires", "Uruguay": "Montevideo",
    "Paraguay": "Asuncion", "Brazil": "Brasilia", "Australia": "Canberra",
    "New Zealand": "Wellington", "Fiji": "Suva", "Papua New Guinea": "Port Moresby",
}
#: Accepted spellings besides the name above.
ALSO = {
    "Kyiv": ["Kiev"], "Washington": ["Washington, D.C."], "Bogota": ["Bogotá"],
    "San Jose": ["San José"], "Asuncion": ["Asunción"], "Brasilia": ["Brasília"],
    "Reykjavik": ["Reykjavík"], "Sanaa": ["Sana'a", "Sana"], "Ulaanbaatar": ["Ulan Bator"],
    "Astana": ["Nur-Sultan"], "Sucre": ["La Paz"],
}

ELEMENTS = {
    "hydrogen": "H", "helium": "He", "lithium": "Li", "carbon": "C", "nitrogen": "N",
    "oxygen": "O", "fluorine": "F", "neon": "Ne", "sodium": "Na", "magnesium": "Mg",
    "aluminium": "Al", "silicon": "Si", "phosphorus": "P", "sulfur": "S",
    "chlorine": "Cl", "argon": "Ar", "potassium": "K", "calcium": "Ca", "iron": "Fe",
    "copper": "Cu", "zinc": "Zn", "silver": "Ag", "tin": "Sn", "iodine": "I",
    "gold": "Au", "mercury": "Hg", "lead": "Pb", "uranium": "U", "nickel": "Ni",
    "cobalt": "Co", "platinum": "Pt", "tungsten": "W", "titanium": "Ti",
    "chromium": "Cr", "manganese": "Mn", "boron": "B", "beryllium": "Be",
    "bromine": "Br", "krypton": "Kr", "xenon": "Xe", "radon": "Rn", "barium": "Ba",
    "strontium": "Sr", "cesium": "Cs", "arsenic": "As", "selenium": "Se",
    "antimony": "Sb", "bismuth": "Bi", "plutonium": "Pu", "radium": "Ra",
}

SYSTEM = "Answer with the answer only, in as few words as possible."


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def facts(rng: random.Random) -> list[dict]:
    items = []
    for country, city in CAPITALS.items():
        answers = [city, *ALSO.get(city, [])]
        items.append({"id": f"capital-{len(items):03d}",
                      "messages": chat(f"What is the capital of {country}?"),
                      "answer": answers})
    for name, symbol in ELEMENTS.items():
        items.append({"id": f"element-{len(items):03d}",
                      "messages": chat(f"What is the chemical symbol of {name}?"),
                      "answer": symbol})
    cities = sorted(set(CAPITALS.values()))
    for country, city in list(CAPITALS.items())[::2]:
        options = [*rng.sample([c for c in cities if c != city], 3), city]
        rng.shuffle(options)
        items.append({"id": f"choice-{len(items):03d}",
                      "messages": chat(f"What is the capital of {country}? Options: "
                                       + ", ".join(options) + "."),
                      "answer": city, "choices": options})
    rng.shuffle(items)  # so that alternate halves mix the kinds of question
    return items


def arithmetic(rng: random.Random) -> list[dict]:
    items = []
    for digits in (1, 2, 3):
        lo, hi = 10 ** (digits - 1), 10**digits - 1  # no 0: "a + 0 = a" would match "a"
        for _ in range(60):
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            items.append({"id": f"add{digits}-{len(items):03d}",
                          "messages": chat(f"What is {a} + {b}?"), "answer": str(a + b)})
    for digits in (1, 2):
        lo, hi = 2 if digits == 1 else 10, 10**digits - 1
        for _ in range(40):
            a, b = rng.randint(lo, hi), rng.randint(2, 9)
            items.append({"id": f"mul{digits}-{len(items):03d}",
                          "messages": chat(f"What is {a} times {b}?"), "answer": str(a * b)})
    rng.shuffle(items)
    return items


#: generated.jsonl's own seed (facts and arithmetic keep theirs, byte for byte).
GENERATED_SEED = 3030


def _numbers(rng: random.Random, digits: int) -> int:
    return rng.randint(1 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def generated(rng: random.Random) -> list[dict]:
    """Free-text families (200 each, by digit count where there is one) and two-way
    choices (200 each): an exact answer for every question, in a range of difficulty
    where SmolLM2-135M-Instruct is sometimes right. No free-text answer equals a number
    in its question, so a reply that only echoes the question never matches."""
    items: list[dict] = []

    def add(kind: str, question: str, answer: str, choices: list[str] | None = None) -> None:
        item: dict = {"id": f"{kind}-{len(items):04d}", "messages": chat(question),
                      "answer": answer}
        if choices is not None:
            item["choices"] = choices
        items.append(item)

    for i in range(200):
        a, b = _numbers(rng, 1 + i % 3), _numbers(rng, 1 + i % 3)
        add(f"add{1 + i % 3}", f"What is {a} + {b}?", str(a + b))
    for i in range(200):
        a, b = sorted((_numbers(rng, 1 + i % 2), _numbers(rng, 1 + i % 2)), reverse=True)
        while a in (b, 2 * b):  # the answer would be an operand: an echo would match
            a += 1
        add(f"sub{1 + i % 2}", f"What is {a} - {b}?", str(a - b))
    for i in range(200):
        a, b = max(2, _numbers(rng, 1 + i % 2)), rng.randint(2, 9)
        add(f"mul{1 + i % 2}", f"What is {a} times {b}?", str(a * b))
    for i in range(200):
        n = _numbers(rng, 1 + i % 3)
        add(f"next{1 + i % 3}", f"What number comes after {n}?", str(n + 1))
    for i in range(200):
        n = _numbers(rng, 1 + i % 3) + 1
        add(f"prev{1 + i % 3}", f"What number comes before {n}?", str(n - 1))
    for i in range(200):
        n = _numbers(rng, 1 + i % 3)
        add(f"double{1 + i % 3}", f"What is double {n}?", str(2 * n))
    for i in range(200):
        a, b = rng.sample(range(1, 10 ** (1 + i % 3)), 2)
        add(f"larger{1 + i % 3}", f"Which is larger, {a} or {b}?", str(max(a, b)),
            [str(a), str(b)])
    for i in range(200):
        n = _numbers(rng, 1 + i % 3)
        add(f"parity{1 + i % 3}", f"Is {n} even or odd?", "even" if n % 2 == 0 else "odd",
            ["even", "odd"])
    rng.shuffle(items)  # so that alternate halves mix the families
    return items


def write(name: str, items: list[dict]) -> None:
    with (HERE / name).open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    rng = random.Random(SEED)
    write("facts.jsonl", facts(rng))
    write("arithmetic.jsonl", arithmetic(rng))
    write("generated.jsonl", generated(random.Random(GENERATED_SEED)))
