"""Write knowledge.jsonl beside this script: general-knowledge questions with short answers.

Questions written for tokentrail, released under the project's MIT licence: the facts are
common knowledge; the wording, the selection, the accepted alternatives and the
distractors are ours. Free-text families: the past tense of an irregular verb, the plural
of a noun, the opposite of a word, the continent of a country, the name of an animal's
young, the author of a book, the day or month after or before another, and science and
geography single facts. Choice families: whether a city is a country's capital (yes or
no, capitals from make_sets.CAPITALS) and the opposite of a word among four options.
No accepted free-text answer appears as whole words in its question (asserted below), so
a reply that only echoes the question never matches. Run `python make_knowledge.py` to
rebuild the file byte for byte (one seed, `random.Random(3131)`).
"""

from __future__ import annotations

import functools
import random
import sys
import unicodedata
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # make_sets.py sits beside this script, whatever the cwd
    sys.path.insert(0, str(HERE))

from make_sets import CAPITALS, SYSTEM, chat, write  # noqa: E402

SEED = 3131


def table(text: str) -> dict[str, list[str]]:
    """'key=a/b; key2=c' (entries split by ';' or new lines) -> {key: [a, b], key2: [c]}."""
    out: dict[str, list[str]] = {}
    for entry in text.replace("\n", ";").split(";"):
        if entry.strip():
            key, _, answers = entry.partition("=")
            assert key.strip() not in out, key
            out[key.strip()] = [a.strip() for a in answers.split("/")]
    return out


#: Irregular verbs (none whose past tense is the verb itself: put, cut, hit, read, ...).
PAST = table("""
go=went; eat=ate; see=saw; take=took; write=wrote; swim=swam; bring=brought; think=thought
teach=taught; catch=caught; fly=flew; draw=drew; drink=drank; sing=sang; begin=began
give=gave; come=came; run=ran; buy=bought; fight=fought; sell=sold; tell=told; find=found
feel=felt; keep=kept; sleep=slept; leave=left; meet=met; speak=spoke; break=broke
choose=chose; freeze=froze; steal=stole; drive=drove; ride=rode; stand=stood; know=knew
grow=grew; throw=threw; fall=fell; hold=held; lose=lost; send=sent; build=built
spend=spent; make=made; say=said; pay=paid; sit=sat; win=won; forget=forgot; hide=hid
wear=wore; feed=fed; lead=led; hear=heard; dream=dreamed/dreamt; learn=learned/learnt
spell=spelled/spelt; burn=burned/burnt; smell=smelled/smelt; kneel=knelt/kneeled
leap=leaped/leapt
""")

#: Nouns with irregular or tricky plurals (none whose plural is the noun itself).
PLURAL = table("""
mouse=mice; child=children; tooth=teeth; foot=feet; goose=geese; woman=women; man=men
person=people/persons; ox=oxen; louse=lice; cactus=cacti/cactuses; fungus=fungi/funguses
nucleus=nuclei/nucleuses; octopus=octopuses/octopi/octopodes; crisis=crises; thesis=theses
phenomenon=phenomena; criterion=criteria; bacterium=bacteria; appendix=appendices/appendixes
index=indexes/indices; knife=knives; leaf=leaves; wolf=wolves; half=halves; wife=wives
life=lives; shelf=shelves; loaf=loaves; thief=thieves; calf=calves; hoof=hooves/hoofs
scarf=scarves/scarfs; potato=potatoes; tomato=tomatoes; hero=heroes; echo=echoes
city=cities; baby=babies; monkey=monkeys; box=boxes; fox=foxes; bus=buses/busses
church=churches; quiz=quizzes; chief=chiefs; photo=photos; piano=pianos
""")

#: Words with clear antonyms, every common antonym accepted; the first is the choice answer.
OPPOSITE = table("""
hot=cold; big=small/little/tiny; fast=slow; happy=sad/unhappy; up=down
open=closed/shut/close; early=late; full=empty; strong=weak; rich=poor; tall=short
hard=soft/easy; wet=dry; clean=dirty; good=bad/evil; true=false/untrue; love=hate/hatred
day=night; black=white; north=south; east=west; inside=outside
above=below/beneath/under/underneath; before=after; push=pull; buy=sell; thick=thin
wide=narrow; deep=shallow; loud=quiet/soft/silent; friend=enemy/foe; laugh=cry/weep
question=answer/reply; asleep=awake; always=never; everything=nothing; maximum=minimum
accept=reject/refuse/decline; cheap=expensive/dear/costly; smooth=rough/bumpy
polite=rude/impolite; innocent=guilty; male=female; king=queen; brother=sister
uncle=aunt; positive=negative; success=failure; future=past; entrance=exit
import=export; inhale=exhale; dead=alive/living; near=far/distant; forget=remember/recall
winter=summer; borrow=lend/loan; horizontal=vertical; win=lose/loss/defeat; heavy=light
""")
#: Words whose antonyms are too close to one another's to serve as distractors.
KIN = ["big tall thick wide deep heavy strong", "up above inside entrance", "north east",
       "early before future day winter hot fast", "good love friend polite happy",
       "hard smooth loud", "king male brother uncle", "rich cheap", "win success",
       "buy borrow import push", "asleep dead", "always everything full", "true innocent"]

#: Countries wholly (or by convention) on one continent; no transcontinental ones.
CONTINENTS = {
    "Africa": "Kenya; Nigeria; Egypt; Ghana; Ethiopia; Morocco; Algeria; Tunisia; Senegal; "
              "Mali; Uganda; Tanzania; Zimbabwe; Zambia; Angola; Madagascar; Cameroon; Botswana",
    "Asia": "China; Japan; India; Pakistan; Bangladesh; Nepal; Thailand; Vietnam; Cambodia; "
            "Malaysia; the Philippines; Mongolia; Afghanistan; Iran; Iraq; Saudi Arabia; "
            "South Korea; Uzbekistan",
    "Europe": "France; Germany; Italy; Spain; Portugal; the United Kingdom; Ireland; Belgium; "
              "the Netherlands; Austria; Switzerland; Poland; Greece; Sweden; Norway; "
              "Finland; Iceland; Hungary",
    "North America": "the United States; Canada; Mexico; Cuba; Jamaica; Guatemala; Honduras; "
                     "Costa Rica; Panama; Haiti; Nicaragua",
    "South America": "Brazil; Argentina; Chile; Peru; Colombia; Venezuela; Ecuador; Bolivia; "
                     "Paraguay; Uruguay; Guyana; Suriname",
    "Oceania": "New Zealand; Fiji; Papua New Guinea; Samoa; Tonga; Vanuatu",
}
#: Accepted besides the continent's name.
CONTINENT_ALSO = {"Oceania": ["Australia"]}

#: Animal -> the name of its young.
YOUNG = table("""
cow=calf; cat=kitten; dog=puppy/pup; sheep=lamb; horse=foal/colt/filly; goat=kid
pig=piglet; duck=duckling; frog=tadpole/froglet/polliwog; kangaroo=joey; bear=cub
lion=cub; tiger=cub; deer=fawn; swan=cygnet; goose=gosling; owl=owlet; chicken=chick
eagle=eaglet; seal=pup; elephant=calf; whale=calf; giraffe=calf; hare=leveret
koala=joey; fox=kit/cub/pup; wolf=pup/cub; zebra=foal/colt/filly
donkey=foal/colt/filly; panda=cub
""")

#: Book or play -> its author's surname (a fuller form where the surname alone would
#: also match someone else's name, and common transliterations).
AUTHOR = table("""
Pride and Prejudice=Austen; Hamlet=Shakespeare; Macbeth=Shakespeare
War and Peace=Tolstoy/Tolstoi; Crime and Punishment=Dostoevsky/Dostoyevsky/Dostoevski
Don Quixote=Cervantes; Nineteen Eighty-Four=Orwell; Animal Farm=Orwell; Oliver Twist=Dickens
A Christmas Carol=Dickens; The Great Gatsby=Fitzgerald; To Kill a Mockingbird=Harper Lee
The Catcher in the Rye=Salinger; Moby-Dick=Melville
The Adventures of Tom Sawyer=Twain/Clemens; The Old Man and the Sea=Hemingway
The Grapes of Wrath=Steinbeck; The Hobbit=Tolkien
Alice's Adventures in Wonderland=Carroll/Dodgson; The Divine Comedy=Dante/Alighieri
Les Misérables=Hugo; The Three Musketeers=Dumas; Around the World in Eighty Days=Verne
Madame Bovary=Flaubert; The Metamorphosis=Kafka; Faust=Goethe; Robinson Crusoe=Defoe
Gulliver's Travels=Swift; Treasure Island=Stevenson; The Jungle Book=Kipling
The War of the Worlds=Wells; Dracula=Stoker; The Picture of Dorian Gray=Wilde
Frankenstein=Mary Shelley/Mary Wollstonecraft Shelley
Jane Eyre=Charlotte Brontë/Charlotte Bronte; Wuthering Heights=Emily Brontë/Emily Bronte
Lord of the Flies=Golding; Brave New World=Huxley; Fahrenheit 451=Bradbury
One Hundred Years of Solitude=Márquez/Marquez; Paradise Lost=Milton
The Canterbury Tales=Chaucer; The Odyssey=Homer; A Doll's House=Ibsen
On the Origin of Species=Darwin; Little Women=Alcott; Uncle Tom's Cabin=Stowe
The Hound of the Baskervilles=Doyle; Murder on the Orient Express=Christie
""")

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]

#: Science and geography questions with one undisputed short answer.
TRIVIA = table("""
What is the largest planet in the solar system?=Jupiter
Which planet is known as the Red Planet?=Mars
Which planet is closest to the Sun?=Mercury
Which is the hottest planet in the solar system?=Venus
Which planet is famous for its large rings?=Saturn
How many planets are in the solar system?=8/eight
What is the largest ocean on Earth?=Pacific
Which ocean lies between Europe and North America?=Atlantic
What is the longest river in Africa?=Nile
What is the longest river in South America?=Amazon
What is the highest mountain in the world above sea level?=Everest/Chomolungma/Sagarmatha
What is the largest hot desert in the world?=Sahara
What is the largest continent by area?=Asia
What is the largest country by area?=Russia
In which country are the pyramids of Giza?=Egypt
What is the hardest natural substance?=diamond/diamonds
What gas do plants take in from the air to make food?=carbon dioxide/CO2
What gas do humans need to breathe in to live?=oxygen/O2
Which gas makes up most of Earth's atmosphere?=nitrogen/N2
What is the chemical formula of water?=H2O
What is the freezing point of water in degrees Celsius?=0/zero
What is the boiling point of water at sea level in degrees Celsius?=100/one hundred
Which metal is liquid at room temperature?=mercury
What force pulls objects towards the Earth?=gravity/gravitation
What is the centre of an atom called?=nucleus
What is the largest organ of the human body?=skin
Which organ pumps blood around the body?=heart
What is the longest bone in the human body?=femur/thigh bone/thighbone
How many bones are in the adult human body?=206/two hundred and six/two hundred six
How many legs does a spider have?=8/eight
How many legs does an insect have?=6/six
How many sides does a hexagon have?=6/six
How many sides does a triangle have?=3/three
How many continents are there?=7/seven
How many days are in a leap year?=366/three hundred and sixty-six/three hundred sixty-six
How many minutes are in an hour?=60/sixty
How many hours are in a day?=24/twenty-four
What is the fastest land animal?=cheetah/cheetahs
What is the largest mammal?=blue whale/blue whales
What is the tallest animal?=giraffe/giraffes
Who was the first person to walk on the Moon?=Armstrong
Who developed the theory of relativity?=Einstein
What colour do you get by mixing blue and yellow?=green
What is the smallest prime number?=2/two
What do bees make from nectar?=honey
""")

#: Left out of the yes/no capitals: two capitals (Bolivia), a city-state (Singapore), an
#: official capital other than the best-known city (Sri Lanka), a contested seat (Yemen).
NOT_YES_NO = {"Bolivia", "Singapore", "Sri Lanka", "Yemen"}


def words(text: str) -> str:
    """The matcher's normal form: NFKC, case folded, punctuation and symbols to spaces."""
    text = unicodedata.normalize("NFKC", text).casefold()
    return " ".join("".join(" " if unicodedata.category(c)[0] in "PSZC" else c
                            for c in text).split())


def add_item(items: list[dict], family: str, question: str, answers: list[str],
             choices: list[str] | None = None) -> None:
    """Append one question (id: its family and its place in `items`), checked: a
    free-text answer never sits in its question as whole words (an echo must not match),
    a choice's answer is one of 2 to 4 options that read differently."""
    if choices is None:
        for a in answers:
            assert words(a) and f" {words(a)} " not in f" {words(question)} ", (question, a)
    else:
        assert len(answers) == 1 and answers[0] in choices, (question, choices)
        assert 2 <= len({words(c) for c in choices}) == len(choices) <= 4, (question, choices)
    item: dict = {"id": f"{family}-{len(items):04d}", "messages": chat(question),
                  "answer": answers[0] if len(answers) == 1 else answers}
    if choices is not None:
        item["choices"] = choices
    items.append(item)


def knowledge(rng: random.Random) -> list[dict]:
    items: list[dict] = []

    add = functools.partial(add_item, items)

    for verb, answers in PAST.items():
        add("past", f"What is the past tense of '{verb}'?", answers)
    for noun, answers in PLURAL.items():
        add("plural", f"What is the plural of '{noun}'?", answers)
    for word, answers in OPPOSITE.items():
        add("opposite", f"What is the opposite of '{word}'?", answers)
    for continent, countries in CONTINENTS.items():
        for country in countries.split("; "):
            add("continent", f"On which continent is {country}?",
                [continent, *CONTINENT_ALSO.get(continent, [])])
    for animal, answers in YOUNG.items():
        add("young", f"What is a baby {animal} called?", answers)
    for title, answers in AUTHOR.items():
        add("author", f"Who wrote '{title}'?", answers)
    for kind, names in (("day", DAYS), ("month", MONTHS)):
        for i, name in enumerate(names):
            add("sequence", f"What {kind} comes after {name}?", [names[(i + 1) % len(names)]])
            add("sequence", f"What {kind} comes before {name}?", [names[i - 1]])
    for question, answers in TRIVIA.items():
        add("trivia", question, answers)

    countries = [c for c in CAPITALS if c not in NOT_YES_NO]
    cities = sorted(CAPITALS[c] for c in countries)
    for i, country in enumerate(rng.sample(countries, 60)):
        city = CAPITALS[country]
        if i % 2:  # another country's capital
            city = rng.choice([c for c in cities if c != city])
        add("capital_yes_no", f"Is {city} the capital of {country}?",
            ["yes" if city == CAPITALS[country] else "no"], ["yes", "no"])

    firsts = {word: answers[0] for word, answers in OPPOSITE.items()}
    for word in rng.sample(list(OPPOSITE), 40):
        kin = {k for group in KIN if word in group.split() for k in group.split()} | {word}
        banned = {words(a) for a in OPPOSITE[word]} | {words(word)}
        pool = sorted({a for w, a in firsts.items() if w not in kin and words(a) not in banned})
        options = [*rng.sample(pool, 3), firsts[word]]
        rng.shuffle(options)
        add("opposite_choice", f"What is the opposite of '{word}'? Options: "
            + ", ".join(options) + ".", [firsts[word]], options)

    rng.shuffle(items)  # so that alternate halves mix the families
    return items


def print_families(items: list[dict]) -> None:
    """How many items each family has (in the order they were made), and the total."""
    first: dict[str, int] = {}  # family -> its first id number
    for item in items:
        family, number = item["id"].rsplit("-", 1)
        first[family] = min(first.get(family, len(items)), int(number))
    counts = Counter(item["id"].rsplit("-", 1)[0] for item in items)
    for family in sorted(first, key=first.__getitem__):
        print(f"{family:20} {counts[family]}")
    choices = sum("choices" in item for item in items)
    print(f"{'total':20} {len(items)} ({choices} choices, {choices / len(items):.0%})")


if __name__ == "__main__":
    items = knowledge(random.Random(SEED))
    assert items[0]["messages"][0]["content"] == SYSTEM
    write("knowledge.jsonl", items)
    print_families(items)
